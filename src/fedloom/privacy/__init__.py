"""Differential privacy: the accountant (:mod:`.accountant`) and client-level DP-FedAvg
(:mod:`.client_level`), which acts through the transform chain."""
