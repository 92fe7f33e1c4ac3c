"""What a federated run is read against (``[eval] baselines``).

- ``majority`` (:mod:`fedloom.evaluation.majority`): each client predicting its most
  frequent training label, scored where the client's adapters are scored. Under label skew
  it can reach a high accuracy while it has learnt nothing of the task; the run's adapters
  must beat it on a metric a constant cannot win (balanced accuracy, macro-F1) to show
  they learnt more than the label prior.
- ``local`` (:mod:`.local`): each client training alone, with the run's local training and
  as many rounds, nothing shared: what a party had without the federation.

Both land in ``summary.json`` beside ``global`` and ``personal``, under their own names.
"""

BASELINES = ("local", "majority")
