"""Typed errors a user can cause; each message says what is wrong and what to do next."""


class ParaVTError(Exception):
    """Base class of every error ParaVT raises on purpose."""


class VideoError(ParaVTError):
    """A video cannot be opened or the requested frames cannot be decoded."""


class ToolError(ParaVTError):
    """A tool call is invalid (unknown tool, bad arguments, window outside the video)."""


class PolicyError(ParaVTError):
    """The model behind the agent failed (endpoint unreachable, bad response, model missing)."""


class ConfigError(ParaVTError):
    """A configuration file or option is invalid."""
