"""Hugging Face classes of concept models: ``PretrainedConfig`` / ``PreTrainedModel`` per family.

The two modules here are also written, unchanged, into every ``concept export`` folder, whose
``config.json`` names them in its ``auto_map``: ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` then imports them from the folder and opens it with ``concept.load``
(so the ``concept`` library must be installed where the folder is loaded). ``concept.hub`` writes
the files and holds the hub logic (``save_pretrained``, ``push_to_hub``, hub ids).
"""
