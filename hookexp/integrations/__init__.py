"""hookexp in the training loops researchers use most: :mod:`hookexp.integrations.lightning` (extra
``.[lightning]``) and :mod:`hookexp.integrations.hf` (the ``transformers`` Trainer, extra ``.[hf]``). Each is a
callback that attaches hook specs and the trainer's statistics probes (:class:`hookexp.Watch`) when training
starts, removes them when it ends, and logs through the loop's own logger or W&B run."""
