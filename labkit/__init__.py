"""labkit: a Jupyter-driven cluster lab for BERT-style MLM pretraining and for measuring how it scales.

Notebooks, the ``labkit`` command and tests call the same functions. The layers import one way,
from the surface down:

- surface: ``labkit.lab`` (the stages over an ipyparallel cluster: corpus, clean, tokenizer,
  shards, staging, training, sweeps), ``labkit.commands`` and ``labkit.cli`` (the ``labkit``
  command), ``labkit.demo`` (``labkit demo``), ``labkit.report`` (notebooks as HTML reports),
  ``labkit.plots``, ``labkit.live`` and ``labkit.tables`` (what a notebook shows), ``labkit.export``
  (a run as a transformers model);
- ``labkit.study``: memory planning, scaling models, scaling-law fits, sweeps;
- ``labkit.train``: one MLM pretraining run as one rank of many (DDP, ZeRO-1, FSDP2, tensor and
  pipeline parallel), checkpoints and exact resume;
- ``labkit.model``: the encoder ``BertMLM``, its parameter and FLOP counts, transformers interop;
- ``labkit.data`` and ``labkit.cluster`` below them: the corpus to token shards, and the engines;
- shared by all: ``labkit.config`` (every setting, as dataclasses and TOML), ``labkit.measure``
  (each measurement defined once, the device table), ``labkit.io`` (durable writes), ``labkit.env``,
  ``labkit.workdir``.

Importing ``labkit`` imports nothing else; each module lists its public names in ``__all__``.
Start with the README, or ``labkit --help``.
"""
