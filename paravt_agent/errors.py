"""Typed errors a user can cause; each message says what is wrong and what to do next."""


class ParaVTError(Exception):
    """Base class of every error ParaVT raises on purpose."""


class VideoError(ParaVTError):
    """A video cannot be opened or the requested frames cannot be decoded."""


class ToolError(ParaVTError):
    """A tool call is invalid (unknown tool, bad arguments, window outside the video)."""


class PolicyError(ParaVTError):
    """The model behind the agent failed (endpoint unreachable, bad response, model missing).

    ``transient`` errors (connection refused, 5xx, 429) are retried by the graph's retry policy.
    """

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class PromptTooLong(PolicyError):
    """A question, an option or the whole prompt is over its token limit (refused before any model call)."""


class ConfigError(ParaVTError):
    """A configuration file or option is invalid."""
