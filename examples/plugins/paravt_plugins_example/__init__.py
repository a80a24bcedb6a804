"""Example ParaVT plugins: each module is one extension point, registered in ``pyproject.toml``."""
