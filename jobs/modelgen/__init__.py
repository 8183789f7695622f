"""Generated models: small Llama-shaped model directories vLLM serves without a download.

:mod:`~jobs.modelgen.generator` writes them (weights, config, a tokenizer trained on
the shipped corpus) and loads their tokenizer; :mod:`~jobs.modelgen.corpus` is that
offline English corpus (``jobs/data/corpus.txt``), also the source of the request
texts of :mod:`jobs.load`. Imports nothing else of ``jobs``.
"""
