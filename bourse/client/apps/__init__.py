"""Apps as a whole: a spec file (spec), the slots' order ids (slots), a pure planner (plan),
the rollout as a pure state machine (rollout), the applied spec kept in JetStream KV (store)
and the shell that converges an app to its spec (apply)."""
