"""Every model family: importing this module registers each one in models/family.py's FAMILIES (the
plugin load vLLM's and mini-sglang's model registries do by name). A new family is one module here."""

from . import (  # noqa: F401  (each registers itself)
    deepseek,
    glm4_moe,
    gpt_oss,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,
    qwen3_next,
)
