/* Halfway dashboard: the address's fragment, which holds what a link should open. A leaf:
 * writing it is all this does; app.js's selectFromHash reads it back on each hashchange. */

// The address's fragment holds what a link should open: job=ID, tab=log|artifacts|...,
// compare=ID,ID,... and compare_steps=FROM-TO (the comparison's zoom). Selecting a job or a
// panel adds a history entry (back/forward work); a comparison edit replaces the current one.

export function hashParams() {
  return new URLSearchParams(location.hash.slice(1));
}

export function setHash(changes, push) {
  const p = hashParams();
  for (const [key, value] of Object.entries(changes)) {
    if (value === null || value === undefined || value === "") p.delete(key);
    else p.set(key, String(value));
  }
  const text = p.toString().replace(/%2C/gi, ",");
  if (push) {
    location.hash = text; // hashchange does the rest
  } else {
    history.replaceState(null, "", location.pathname + location.search + (text ? "#" + text : ""));
  }
}

export function selectJob(id) {
  setHash({ job: id }, true);
}
