"""Supernet training and architecture search: samplers, data, evolution, config and the app.

``python -m search`` runs it all from the Hydra config in ``conf/``; :func:`search.app.run`
is the same run as a plain function of the composed config.
"""
from __future__ import annotations

from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, RunConfig, build_data, build_space, load_config
from .data import DataError, Dataset, Digits, Synthetic
from .evolution import (Candidate, Constraints, SearchError, SearchResult, SubnetCost, evolution_search,
                        random_search)
from .samplers import FairSampler, Sampler, SamplerError, UniformSampler, make_sampler

__all__ = [
    "Candidate", "Checkpoint", "CheckpointError", "ConfigError", "Constraints", "DataError", "Dataset",
    "Digits", "FairSampler", "RunConfig", "Sampler", "SamplerError", "SearchError", "SearchResult",
    "SubnetCost", "Synthetic", "UniformSampler", "build_data", "build_space", "evolution_search",
    "load_checkpoint", "load_config", "make_sampler", "random_search", "save_checkpoint",
]
