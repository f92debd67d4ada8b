"""Files users send and jobs make: ``storage`` (a local directory or an S3-compatible bucket,
behind one ``Store`` interface: ``FileStore``, ``S3Store``), ``code`` (code bundles checked and
named by their content), ``archives`` (an uploaded archive unpacked under bounds),
``codestore`` (where bundles live and each host's cache of them) and ``datasets`` (uploaded
``.npz`` files checked from their headers)."""
