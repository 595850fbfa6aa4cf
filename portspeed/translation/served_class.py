"""What the translated torch view serves in place of a torch class: still a class, making the adapter's object.

Why: framework code reads torch's classes as classes, not only calls them. Megatron-LM main
annotates a class attribute ``torch.cuda.Stream | None`` (``megatron_fsdp/experimental``), so
a plain function in the view made ``|`` raise TypeError at import; ``isinstance(x,
torch.cuda.Event)``, ``Optional[torch.cuda.Stream]`` and ``class S(torch.cuda.Stream)`` need a
class too. Yet calling it must give the adapter's object (a ``NullStream`` on the CPU, a
``torch.Stream`` on a PrivateUse1 device), not an instance of some portspeed class, because
that object is what the adapter's other calls and torch's ops accept.

Contract: ``served_class(name, make, real=..., also=..., probe=...)`` returns a class whose
metaclass is ``ServedClass``:

- calling it returns ``make(*args, **kwargs)`` (the adapter's object);
- ``isinstance(obj, it)`` is True for an instance of ``real`` (torch's own class), of any
  class in ``also`` (torch's device-generic base, e.g. ``torch.Stream``), of any type it has
  made, and of the type ``probe()`` names (e.g. the adapter's current stream's type);
- ``X | None``, ``Optional[X]``, ``issubclass`` and subclassing work as for any class;
  constructing a *subclass* raises UnsupportedCudaCallError (the adapter makes its own
  objects; a subclass's methods could not be on them);
- a class attribute it lacks (``torch.cuda.Stream.priority_range``) raises
  UnsupportedCudaCallError naming it (an AttributeError, so ``hasattr`` answers False).
"""

from __future__ import annotations

from typing import Any, Callable

from portspeed.errors import UnsupportedCudaCallError

__all__ = ["ServedClass", "served_class"]


def _adapter_name() -> str:
    from portspeed.accelerator import get_accelerator

    try:
        return repr(get_accelerator().name)
    except Exception:  # an error message must not fail on a second error
        return "the selected"


class ServedClass(type):
    """Metaclass of the view's stand-ins for torch classes (see the module docstring)."""

    __portspeed_make__: Callable[..., Any] | None
    __portspeed_kinds__: tuple[type, ...]
    __portspeed_made__: list[type]
    __portspeed_probe__: Callable[[], type | None] | None

    def _served_base(cls) -> bool:
        return cls.__dict__.get("__portspeed_make__") is not None

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not cls._served_base():
            raise UnsupportedCudaCallError(
                f"{cls.__module__}.{cls.__qualname__} subclasses the translated {cls._served_name()}; constructing "
                f"a subclass has no translation for the {_adapter_name()} adapter (its objects are the adapter's "
                "own type, which cannot carry the subclass's methods); construct the base class, or report an "
                "issue naming this class"
            )
        obj = cls.__portspeed_make__(*args, **kwargs)  # type: ignore[misc]
        made = cls.__portspeed_made__
        if type(obj) not in made:
            made.append(type(obj))
        return obj

    def _served_name(cls) -> str:
        for klass in cls.__mro__:
            if isinstance(klass, ServedClass) and klass._served_base():
                return f"{klass.__module__}.{klass.__qualname__}"
        return cls.__qualname__  # pragma: no cover - every subclass has a served base

    def _kinds(cls) -> tuple[type, ...]:
        kinds = (*cls.__portspeed_kinds__, *cls.__portspeed_made__)
        probe = cls.__portspeed_probe__
        if probe is not None:
            try:
                found = probe()
            except Exception:  # no adapter yet, or one without the query: the other kinds still answer
                found = None
            if found is not None:
                kinds += (found,)
        return kinds

    def __instancecheck__(cls, obj: Any) -> bool:
        if type.__instancecheck__(cls, obj):
            return True
        return cls._served_base() and isinstance(obj, cls._kinds())

    def __subclasscheck__(cls, sub: type) -> bool:
        if type.__subclasscheck__(cls, sub):
            return True
        return cls._served_base() and isinstance(sub, type) and issubclass(sub, cls._kinds())

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        raise UnsupportedCudaCallError(
            f"{cls._served_name()}.{attr} has no translation for the {_adapter_name()} adapter; turn off the "
            "framework option that needs it, or report an issue naming this attribute"
        )


def served_class(name: str, make: Callable[..., Any], *, module: str = "torch.cuda", real: type | None = None,
                 also: tuple[type | None, ...] = (), probe: Callable[[], type | None] | None = None,
                 doc: str = "") -> ServedClass:
    """A class named ``module.name`` whose call is ``make(...)``; ``real``/``also``/``probe``: what is an instance."""
    kinds = tuple(k for k in (real, *also) if isinstance(k, type))
    ns = {
        "__module__": module,
        "__qualname__": name,
        "__doc__": doc or f"{module}.{name} as the translated view serves it: calling it makes the adapter's object.",
        "__portspeed_make__": staticmethod(make),
        "__portspeed_kinds__": kinds,
        "__portspeed_made__": [],
        "__portspeed_probe__": staticmethod(probe) if probe is not None else None,
        "__portspeed_original__": real,
    }
    return ServedClass(name, (), ns)
