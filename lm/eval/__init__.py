"""Evaluation: lm-eval-harness in process, local tasks, perplexity by length, duality, generation.

- ``lm.eval.checkpoint.load_checkpoint(path)``: an exported model folder -> (model, tokenizer)
- ``lm.eval.harness.run_lm_eval(model, tokenizer, tasks, ...)``: lm-eval in process (also the training hook)
- ``lm.eval.local_tasks.build_local_tasks(data_dir, out_dir)``: offline tasks from the held-out split
- ``lm.eval.synthetic``: accuracy per length of synthetic tasks (the hook of ``lm train`` with data.source=task),
  ``compare_runs``
- ``lm.eval.ppl``: ``perplexity_by_length``; ``lm.eval.duality``: ``duality``; ``lm.eval.generate``
"""
