"""FAKE vendor modules for tests: stand-ins for hardware this project does not have.

Nothing here talks to a device. Each ``fake_*`` module builds modules that expose the
part of a vendor's API that portspeed's adapters call (the torch.cuda-like device module,
the vendor package import names), backed by CPU generators and plain Python state, and
installs them into ``sys.modules`` / ``torch`` only inside a ``with installed(...)`` block,
removing them afterwards. They are named fake_* so that no one mistakes them for vendor code.

What they are for, and only for: checking the vendor-specific API names the dedicated
adapters rely on (``torch.hpu.random.default_generators``, ``torch.mlu.cnpx``, the bridge's
``Limit`` memory statistic, a missing ``is_bf16_supported``...) and the generic adapter's
device-module path. They answer exactly what an adapter asks, so they prove no port: device
semantics are proven on the test device (``portspeed.testing.testdev``), a real PrivateUse1
device, and on hardware with ``portspeed conformance``.
"""
