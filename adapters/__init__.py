"""Built-in accelerator adapters, one file per device (installed as ``portspeed.adapters``).

Each module imports without its vendor package; the vendor import happens in
``Accelerator.load_vendor`` when the adapter is selected.
"""
