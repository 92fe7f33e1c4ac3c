"""What a federated run is read against (``[eval] baselines``).

- ``majority`` (:mod:`fedloom.evaluation.majority`): each client predicting its most
  frequent training label, scored where the client's adapters are scored. Under label skew
  it can reach a high accuracy while it has learnt nothing of the task; the run's adapters
  must beat it on a metric a constant cannot win (balanced accuracy, macro-F1) to show
  they learnt more than the label prior.
- ``local`` (:mod:`.local`): each client training alone, with the run's local training and
  as many rounds, nothing shared: what a party had without the federation.
- ``zero_shot`` (:func:`fedloom.evaluation.round.evaluate_state`): a causal LM's backbone
  without adapters (the adapter as built: LoRA's B is zero), scored at the last round
  where the global adapter is: what the federation started from.

Each lands in ``summary.json`` beside ``global`` and ``personal``, under its own name.
"""

BASELINES = ("local", "majority", "zero_shot")
