"""The SessionRouter: an HTTP front for agent sessions over the router's TITO (docs/compat.md, SessionRouter).

Modules: `config` (settings), `state` (sessions, trajectories, hang/continue), `app` (the HTTP app), `server`
(`python -m psrl.session`), `thunder` (the thunder_agent session strategy's rounds, pure) and `thunder_driver`
(the loop that reads the router and the sessions and applies them)."""
