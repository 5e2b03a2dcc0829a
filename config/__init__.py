"""The run-config layer: how a key is declared (:func:`~config.settings.setting` on a
part's frozen :class:`~config.settings.Settings` dataclass, or an
:class:`~config.options.Option`) and how the flat run-config is parsed and validated.

Every package of the app may import it; it imports nothing of the app or of Flower.
"""

from config.options import ConfigError, Option, Scalar, parse_options
from config.settings import Choice, Settings, SettingsError, Typed, listed, setting

__all__ = [
    "Choice",
    "ConfigError",
    "Option",
    "Scalar",
    "Settings",
    "SettingsError",
    "Typed",
    "listed",
    "parse_options",
    "setting",
]
