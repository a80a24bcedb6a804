"""ParaVT agent runtime: parallel video tool calling for long-video question answering."""

from paravt_agent.errors import ConfigError, ParaVTError, PolicyError, ToolError, VideoError

__version__ = "0.1.0"

__all__ = ["ConfigError", "ParaVTError", "PolicyError", "ToolError", "VideoError", "__version__"]
