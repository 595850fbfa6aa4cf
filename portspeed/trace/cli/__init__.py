"""The flight recorder's commands: `portspeed why-hung DIR` (``why_hung``) and `portspeed run --hang-timeout S`'s
watchdog (``hang_watch``). Floor: the command line. This file imports nothing."""
