"""The REST routes, one router a subject; api/rest.py (`create_app`) assembles them.

Every route declares its error statuses with `answers(...)` (api/contract.py) and is in
the authorization table (api/auth.py); the handlers hold no SQL and no storage logic."""
