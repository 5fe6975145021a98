"""The Hugging Face ``transformers`` classes this package has rules for, by qualified name.

Nothing is imported: a model holding these layers imported ``transformers`` itself. The
rules are in :mod:`.hf`; :mod:`.tensor_parallel` reads the RMSNorm classes too (exact under
``SequenceParallel``, as ``nn.RMSNorm``), without importing the rules.
"""

from torch import nn

CONV1D = "transformers.pytorch_utils.Conv1D"
RMS_NORMS = (
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
)
T5_LAYER_NORM = "transformers.models.t5.modeling_t5.T5LayerNorm"


def qualified_name(module: nn.Module) -> str:
    """``module.class.qualname`` of ``module``'s class."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"
