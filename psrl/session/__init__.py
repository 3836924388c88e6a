"""The SessionRouter: an HTTP front for agent sessions over the router's TITO (docs/compat.md, SessionRouter).

Modules: `config` (settings), `state` (sessions, trajectories, hang/continue), `app` (the HTTP app), `server`
(`python -m psrl.session`)."""
