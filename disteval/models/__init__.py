"""Model builders: torchvision models by name, safe checkpoint loading, shipped reference CNNs."""
from disteval.models.builders import available_models, build_model, preflight_model, resolve_num_classes
from disteval.models.checkpoint import check_state_dict, load_state_dict_file

__all__ = ["available_models", "build_model", "preflight_model", "resolve_num_classes", "check_state_dict",
           "load_state_dict_file"]
