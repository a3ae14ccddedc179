"""The code that runs in the launcher's process: the ``dlm-triton`` CLI, tritonserver and the
OpenAI proxy started and stopped by PID, the supervisor, the model-repository writer, the
checkpoint fetch and the server distribution. Never imports ``dlm_triton.backend``."""
