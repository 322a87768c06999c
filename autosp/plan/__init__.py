"""The planner: predict a training configuration for a model on a cluster (``python -m autosp.plan``).

`predict` traces the model's AutoSP step on fake tensors, adds DeepSpeed's gradient reduction and optimizer step,
simulates it on a cluster (a preset or a cluster file, `load_cluster`) and prices memory with the ledger: fits or
not, peak per rank by ledger category, step time, and the longest sequence that fits.  It is the one package of
autosp that uses the simulator beyond its workload schema (docs/design.md, "Import direction").
"""

from autosp.plan.cluster_file import cluster_from_dict, load_cluster
from autosp.plan.predict import Prediction, TrainingSetup, predict

__all__ = ["Prediction", "TrainingSetup", "cluster_from_dict", "load_cluster", "predict"]
