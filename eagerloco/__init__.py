"""eagerloco: DiLoCo, Streaming DiLoCo and eager outer updates for training across slow links."""

__version__ = "0.1.0"
