"""Stand-in for the ``vllm`` package (kvdbg tests only); see tests/vllm_standins/README.md."""

__version__ = "0.33.0+kvdbg.standin"
