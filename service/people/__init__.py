"""Users and rights: ``auth`` (users and API tokens, stored as hashes), ``authcache`` (token
checks without a query per poll, yet a replaced token seen at once) and ``grants`` (who may
run code jobs)."""
