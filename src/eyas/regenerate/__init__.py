"""`eyas regenerate`: replace every assistant turn of prepared conversations with the
target's own answer, because a drafter trained on the target's outputs accepts more.

  generate    two interchangeable generators (transformers, vLLM): prompts -> new token ids
  run         the turn-by-turn loop, resume file, and the final `prepare` into a prepared folder
  cli         the subcommand
"""
