"""Test-only helpers: checkpoint generators of every kind with their ground truth
(:mod:`support.checkpoints`) and the offline hub cache (:mod:`support.hub`)."""
