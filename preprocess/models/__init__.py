"""Models: the ``models:`` config (an output name to ``MODULE:FUNCTION``), loading a model once per process, its
identity (a digest of its weights, or the version it carries), and running it over samples in full batches."""
