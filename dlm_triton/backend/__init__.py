"""The code that runs inside the Triton Python stub: ``triton_model.TritonPythonModel`` and
what it uses (request parsing, intake, settings resolution, metrics). Never imports
``dlm_triton.launch``."""
