"""quipu: chat with local GGUF models; sessions resume exactly and instantly."""

__version__ = "0.1.0"
