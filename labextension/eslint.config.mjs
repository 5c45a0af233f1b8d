// ESLint for the extension's TypeScript (the JupyterLab extension template's rules, in
// ESLint 9's flat config). Formatting is prettier's business: eslint-config-prettier turns
// the rules that would argue with it off.
import eslint from '@eslint/js';
import prettier from 'eslint-config-prettier';
import importPlugin from 'eslint-plugin-import';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['lib/', 'node_modules/', '.core/', '../jupyter_gpu_snapshot/'] },
  eslint.configs.recommended,
  ...tseslint.configs.recommended,
  prettier,
  {
    files: ['src/**/*.{ts,tsx}'],
    languageOptions: { parserOptions: { project: './tsconfig.json' } },
    rules: {
      '@typescript-eslint/naming-convention': [
        'error',
        {
          selector: 'interface',
          format: ['PascalCase'],
          custom: { regex: '^I[A-Z]', match: true }
        }
      ],
      '@typescript-eslint/no-unused-vars': ['warn', { args: 'none' }],
      '@typescript-eslint/no-explicit-any': 'off',
      '@typescript-eslint/no-namespace': 'off',
      '@typescript-eslint/no-floating-promises': 'error',
      curly: ['error', 'all'],
      eqeqeq: 'error',
      'prefer-arrow-callback': 'error'
    }
  },
  // Imports flow one way. import/no-cycle finds loops of value imports, which leave a
  // module half initialised when the bundle loads; it skips type-only imports, so the
  // bottom layer below also names what it may import, types included.
  {
    files: ['src/**/*.{ts,tsx}'],
    plugins: { import: importPlugin },
    settings: {
      'import/parsers': { '@typescript-eslint/parser': ['.ts', '.tsx'] },
      'import/resolver': { node: { extensions: ['.ts', '.tsx', '.js'] } }
    },
    rules: { 'import/no-cycle': ['error', { ignoreExternal: true }] }
  },
  {
    // The REST client and the translation default are what every other module builds on.
    files: ['src/api.ts', 'src/translation.ts'],
    rules: {
      'no-restricted-imports': [
        'error',
        {
          patterns: [
            {
              regex: '^\\.\\./|^\\./(?!translation$)',
              message:
                'api.ts and translation.ts are the bottom layer: they import no other module of the extension but translation.ts.'
            }
          ]
        }
      ]
    }
  }
);
