"""The encoder: ``BertMLM`` (single device), its attention variants, counts and transformers interop.

- ``labkit.model.encoder``: ``BertMLM``, ``model_config`` and the named sizes ``MODEL_SIZES``;
- ``labkit.model.attention``: full, sliding-window, Linformer and linear attention, rotary tables;
- ``labkit.model.counts``: parameter counts and training FLOPs per token, in closed form;
- ``labkit.model.hf``: ``BertForMaskedLM`` config and weights both ways, ``export_hf``.

Nothing here imports ``torch.distributed``: parallelism is applied from outside (``labkit.train``).
"""

from labkit.model.counts import count_parameters, flops_per_token
from labkit.model.encoder import IGNORE_INDEX, MODEL_SIZES, BertMLM, Layer, MLMOutput, model_config
from labkit.model.hf import BERT_OPTIONS, export_hf, hf_config, load_hf_state_dict, to_hf_state_dict

__all__ = ["BERT_OPTIONS", "IGNORE_INDEX", "MODEL_SIZES", "BertMLM", "Layer", "MLMOutput", "count_parameters",
           "export_hf", "flops_per_token", "hf_config", "load_hf_state_dict", "model_config", "to_hf_state_dict"]
