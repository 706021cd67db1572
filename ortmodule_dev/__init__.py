"""Development helpers of the ortmodule repository (tests, benchmarks, the demo): not part of the
`ortmodule` package that users install. `ortmodule_dev.fixtures` builds the test models."""
