"""Synthetic state-tracking and memory tasks: group word problems, the D_p monoid mixture, parity,
modular arithmetic (with/without brackets), copying and three MAD tasks; metrics; `source.TaskReader`, the
training data of `lm train` with data.source=task (`lm synth`: lm.train.synth; evaluation: lm.eval.synthetic)."""
from .batch import IGNORE, Batch
from .groups import (Monoid, alternating_group, cyclic_group, dihedral_group, direct_product, is_aperiodic,
                     monoid_by_name, prefix_products, reset_monoid, symmetric_group)
from .metrics import (all_metrics, last_accuracy, per_position_accuracy, scaled_accuracy, sequence_accuracy,
                      token_accuracy)
from .registry import TASKS, Task, build_task, task_parameters

__all__ = [
    "IGNORE", "Batch", "Monoid", "alternating_group", "cyclic_group", "dihedral_group", "direct_product",
    "is_aperiodic", "monoid_by_name", "prefix_products", "reset_monoid", "symmetric_group", "all_metrics",
    "last_accuracy", "per_position_accuracy", "scaled_accuracy", "sequence_accuracy", "token_accuracy",
    "TASKS", "Task", "build_task", "task_parameters",
]
