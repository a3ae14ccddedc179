"""dlm_lab: what proves and builds the engine but never serves: the published decoding loops
restated as oracles (`reference`, `reference_block`), tiny checkpoint fixtures (`testing`,
`testing_diffusion_gemma`) and the training code of the embedded models (`training`).

It may import `dlm_engine`; the serving packages (`dlm_engine`, `dlm_triton`, `openai_proxy`,
`dlm_protocol`, `dlm_client`) never import it.
"""
