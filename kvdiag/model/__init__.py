"""The model layer: what ``--model`` may name (``specs``, without torch), loading it (``load``: hub ids, local
directories, GGUF, the embedded models, tiny random models, LoRA adapters), the families' attention semantics
(``families`` without torch, ``adapters`` with it), exact attention recomputed from recorded q/k
(``attention``), the embedded weights (``embedded``) and token counts without torch (``token_count``)."""
