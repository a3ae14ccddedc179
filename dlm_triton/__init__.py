"""dlm_triton: serving a diffusion language model on Triton, in two processes' packages.

``dlm_triton.backend`` runs inside the Triton Python stub (``TritonPythonModel``, request
parsing, metrics); ``dlm_triton.launch`` runs in the launcher's process (``dlm-triton`` CLI,
tritonserver and proxy start and stop, the supervisor, the model-repository writer). They
import each other never: what both need are the server settings (``dlm_protocol.settings``)
and the instances' shared load board (``dlm_triton.instance_load``).
"""
