"""The OpenVINO backend of predict and evaluate: the choice, the cached conversion, int8 calibration."""
