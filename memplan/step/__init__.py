"""The compiled step: the event IR, the compiler that turns a plan into one frozen list of events
(rounds, slot rings, split-sequence context, the optimizer update; a ring rank's compilers extend
it) and the simulator that times such a list. Imports memplan.plan only: never memplan.search,
never array libraries, never a device."""
