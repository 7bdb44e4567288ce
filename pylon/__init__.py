"""The Pylon service: settings, the request pipeline, forwarding, metrics, admin, CLI."""

from pylon.app import RunningPylon, StartupError, start_pylon
from pylon.config import Settings, load_settings

__all__ = ["RunningPylon", "Settings", "StartupError", "load_settings", "start_pylon"]
