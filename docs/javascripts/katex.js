// Render the math that pymdownx.arithmatex marks (\( \) inline, \[ \] display) with the site's own KaTeX copy.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: true,
  })
})
