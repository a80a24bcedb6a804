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


class FeedbackError(ParaVTError):
    """Feedback that cannot be trained on (an answer that is not one of the options, empty, too long, a span for a
    multiple-choice question, a second answer that conflicts with the first): refused with what to send instead."""


class StoreError(ParaVTError):
    """The trajectory store could not be reached (a database that went away). ``retryable`` says whether the same
    call may simply be made again: reads and idempotent writes may; the message says what to check otherwise."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable
