"""The analysis room: comparisons (compare), findings, export tables, the KV cache and
prompt-prefix analysers (kvcache, prefix) and the advisor; pure (no database, Ray or
HTTP), except service, which builds their inputs from stored runs."""
