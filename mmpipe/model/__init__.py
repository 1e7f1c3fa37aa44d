from .builder import IGNORE_INDEX, ReferenceModel, layer_param_counts, layer_specs, lm_loss  # noqa: F401
from .stage import StageTuple  # noqa: F401
