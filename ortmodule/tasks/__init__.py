"""lm-eval tasks shipped with ortmodule, offline (their data beside their configs): pass
`--include_path $(python -c 'import ortmodule.tasks as t; print(t.TASK_DIR)')` to lm-eval's command, or
`task_manager(names)` to `simple_evaluate`."""

import logging
from pathlib import Path

logger = logging.getLogger("ortmodule")

TASK_DIR = str(Path(__file__).parent)
TASKS = ["ortmodule_arithmetic_mc", "ortmodule_sentences_ppl", "ortmodule_arithmetic_gen", "ortmodule_knowledge_mc",
         "ortmodule_knowledge_gen"]


def task_manager(tasks=None, include_path=None, metadata=None):
    """lm-eval's `TaskManager` over ortmodule's shipped tasks and `include_path`'s folders (a folder or a
    list), with lm-eval's own tasks as well only where `tasks` needs them.

    lm-eval indexes its ~14,700 built-in task configs in every `TaskManager` it builds with them: 15 s
    on a 2-vCPU AMD EPYC (Zen 1), a manager. When every name in `tasks` is a task (not a group or a
    tag) of those folders or a Task object, the manager indexes them alone; otherwise (a built-in task, a
    group, a glob, a config dict, or `tasks` None) lm-eval's tasks are indexed too, as
    `TaskManager(include_path=...)` does. `metadata` is passed on (e.g. {"tokenizer": ...}).
    """
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager

    tasks = [tasks] if isinstance(tasks, str) else tasks
    extra = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
    paths = list(dict.fromkeys([TASK_DIR, *(str(Path(path).resolve()) for path in extra)]))  # TASK_DIR once
    if tasks is not None and not isinstance(tasks, dict):
        own = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
        # Task objects are evaluated as they are: lm-eval's `get_task_dict` asks the manager for names only.
        if all(isinstance(name, Task) or isinstance(name, str) and name in own.all_subtasks for name in tasks):
            return own
    logger.info("ortmodule: indexing lm-eval's built-in tasks (%s)", "not all of the tasks are ortmodule's or "
                "include_path's" if tasks is not None else "no task names given")
    return TaskManager(include_path=paths, metadata=metadata)
