"""`ortmodule-eval`: lm-eval's command line with the `ortmodule` model registered
(lm-eval discovers no plugins, so the registration has to happen in the same process)."""


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    from . import lm_eval  # noqa: F401  (registers --model ortmodule)

    cli_evaluate()


if __name__ == "__main__":
    main()
