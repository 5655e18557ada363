"""kiln behind NVIDIA Triton Inference Server: a Python-backend model, its repository templates and a launcher.

- ``tensors``: the inputs/outputs (TensorRT-LLM's Triton backend names), rendered into config.pbtxt;
- ``protocol``: Triton tensors <-> kiln requests and outputs (pure numpy);
- ``model``: ``TritonPythonModel``, imported by the generated model.py inside Triton's Python-backend stub;
- ``metrics``: kiln's metrics through the Python backend's custom metrics API;
- ``repository``: ``kiln triton-repo`` rendering (jinja2 templates in templates/);
- ``launcher``: the tritonserver bundled in nvidia-pytriton (``kiln serve --frontend triton``).
"""
