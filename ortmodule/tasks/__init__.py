"""lm-eval tasks shipped with ortmodule: pass
`--include_path $(python -c 'import ortmodule.tasks as t; print(t.TASK_DIR)')` or
`TaskManager(include_path=ortmodule.tasks.TASK_DIR)`."""

from pathlib import Path

TASK_DIR = str(Path(__file__).parent)
TASKS = ["ortmodule_arithmetic_mc", "ortmodule_sentences_ppl", "ortmodule_arithmetic_gen", "ortmodule_knowledge_mc",
         "ortmodule_knowledge_gen"]
