-- KEYS: record, index.  ARGV: expected version ('' = absent), version, state, data, index
-- score, key, smtpguard id, message id, upstream id
{{include lib/cas_write.lua}}

return {'ok'}
