// What the panel's markup asks of the browser, in a file because the CSP forbids inline script:
// a form with data-confirm asks before it is sent; the language switcher sends itself on change.
document.addEventListener("submit", (ev) => {
  const form = ev.target;
  if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) ev.preventDefault();
});
document.addEventListener("change", (ev) => {
  if (ev.target.id === "lang-select") ev.target.form.requestSubmit();
});
