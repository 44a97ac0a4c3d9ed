"""What a model is asked: prompt sources (``prompts``: JSONL, plain text, ``builtin:<suite>``), the builtin task
suites and how a generation is graded (``suites``), and the tokens an answer needs (``needed``)."""
